"""The classifiers behind one small interface (`base.Classifier`): built-in and configured
models (config), loading (loader), devices, and the torch and ONNX Runtime backends.

May import: engine.errors, engine.inputs, storage, settings, common.
"""
