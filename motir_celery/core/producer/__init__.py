"""The producer API: send events and batches, start direct runs (sync and async), read results."""
