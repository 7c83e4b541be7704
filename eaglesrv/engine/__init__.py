"""Model definitions, weight loading, the model runner, the sampler and the Engine API."""
