"""RL side of colo_rollout: rollout(), the colocated trainer loop and weight resharding hooks.

Not built yet (a later issue); the inference engine's ``Engine.generate`` is the base it will use.
"""
