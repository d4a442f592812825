"""The worker process: what every worker is on either door (WorkerProcess), the Task replica and its step loop
(replica.py), its data, probe, ledger, held-out sums, emulation and warm-worker bookkeeping. Internal."""
