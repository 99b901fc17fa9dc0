"""spectra: Hessian spectrum analysis for TensorFlow/Keras models."""

__version__ = "0.1.0"
