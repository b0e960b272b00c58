"""The cache stage: drives the cache techniques of ``ditbook.accel`` through the adapter
``ditbook.adapter`` builds from the inspection's facts — the noise floor, the caching-off check of
every technique, calibration, the search on calibration seeds, the confirmation on held-out seeds,
the choice (``ditbook.ship``), the compiled and fp8 checks of it, the shipped adapter module rerun in
a fresh process (``reproduce``) and the upstreamable code (``upstream``). ``CacheSession``
(``stage``) holds the steps the notebook calls; ``cache/results.json`` is
``ditbook.records.CacheResults``.

The caching-off check is a hard gate: a technique that runs with caching off but does not reproduce
the baseline stops the stage (``stage.AdapterCheckFailed``)."""
