"""A serving session over a worker: one step = exchange, apply, schedule, strategy round, collect, record. Also the stall watch used to diagnose a stalled round."""
