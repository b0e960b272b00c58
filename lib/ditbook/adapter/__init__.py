"""The cache adapter: how cache-dit (and diffusers' cache hooks) reach a model's blocks, written as one plain module
imported from its file (``build``, ``source``, ``loopfold``; ``counting``: evaluations counted)."""
