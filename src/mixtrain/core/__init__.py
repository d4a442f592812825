"""The training core: driver-side controller, worker group and bring-up, and the worker actor. Internal."""
