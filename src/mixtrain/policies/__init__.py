"""Pure decisions from measurements (shares, strategy advice, pacing, failures): no Ray, no I/O. Internal."""
