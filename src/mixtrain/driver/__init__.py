"""The driver of a Task run: the controller's states and transitions, and what they call on (the schedule, the
membership changes, balancing, callbacks' hooks, checkpoints, evaluations, the bring-up). Internal."""
