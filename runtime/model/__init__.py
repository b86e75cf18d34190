"""Everything that imports torch: weight loading, the model (models/), the sampler and the model runner.

Importing this package imports no torch; its modules do (runtime.model.loader only inside its functions).
"""
