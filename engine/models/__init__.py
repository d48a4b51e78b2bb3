"""The classifiers behind one small interface (`base.Classifier`): built-in and configured
models (config), loading (loader), devices, and the torch, ONNX Runtime and remote (an Open
Inference Protocol v2 server: remote, remote_client) backends.

May import: engine.errors, engine.inputs, storage, settings, common.
"""
