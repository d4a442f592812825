"""The worker group as the driver sees it: the Ray actors and their placement, forming the collective group,
the typed calls to each worker, membership, admission of replacements, the preflight. Internal."""
