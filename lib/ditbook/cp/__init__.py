"""Context-parallel machinery the parallel techniques share: the CP plan derived from the traced
call conventions (``plan``), checked before any process starts (``dryrun``), masks and uneven
splits (``mask``, ``uneven``), where CP applies (``scope``), attention routing and the GQA path
(``attention``), cache decisions agreed across ranks (``cache_sync``), and what each rank's blocks
really received (``sharding``: the records the sharding checks judge)."""
