"""The `specsot` command line (installed as specsot_mq.cli)."""
