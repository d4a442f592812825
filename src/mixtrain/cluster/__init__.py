"""The Ray cluster: connecting, `mixtrain cluster up/join/status/down`, placing workers on nodes. Internal."""
