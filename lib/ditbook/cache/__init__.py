"""The cache stage: drives the cache techniques of ``ditbook.accel`` through the adapter built from
the inspection's facts, from the noise floor to the choice, its checks and a fresh-process rerun.
``CacheSession`` (``stage``) holds the steps the notebook calls. The caching-off check is a hard gate
(``stage.AdapterCheckFailed``)."""
