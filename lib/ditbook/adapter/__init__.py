"""The cache adapter: how cache-dit (and diffusers' cache hooks) reach a model's blocks, decided from
the architecture facts (``ditbook.arch``) — block lists, forward patterns, the loop fold — and
written as one plain module that is imported from its file, verified by the cache stage and shipped
unchanged (``build``: ``build_cache_adapter -> CacheAdapter``; ``source``: the module's text;
``loopfold``: loop work folded into the blocks; ``counting``: block and attention evaluations
counted on the model, what every cache technique's record is made of)."""
