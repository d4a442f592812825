"""The records that cross between the driver, the group and the workers (messages, rounds, the run's state, the
tunables read once per fit): plain data on the lowest floor of the engine. Internal."""
