"""Context-parallel machinery: plans (``plan``) checked before launch (``dryrun``), masks and uneven splits, CP scope,
attention routing (``attention``), cache decisions agreed across ranks and sharding records."""
