"""The stage processes: each phase of SpecSoT is a small async class (base.Stage) run in its own
process by runner.py, linked to the others by a transport (specsot_mq.transports); launch.py
starts and watches them all."""
