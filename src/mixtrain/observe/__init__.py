"""What a run shows and keeps: run log, live progress, report, worker logs. Reads records, decides nothing. Internal."""
