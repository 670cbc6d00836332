"""What the Snakefile calls when the workflow loads: the config's sources and the checks before any job runs."""
