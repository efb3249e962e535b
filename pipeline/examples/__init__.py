"""Example projects: small models trained on bundled data and exported to ONNX."""
