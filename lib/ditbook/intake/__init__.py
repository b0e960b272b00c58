"""The intake stage: gate check, environment, offline load, baseline images."""
