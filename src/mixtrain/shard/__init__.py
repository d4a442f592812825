"""Models larger than one device: gradients and weights sliced by owner across the workers (the sliced strategy,
its block gathers and reduces onto owners) and the block finder. Internal."""
