"""skuforge: build, gate, benchmark and describe ML inference engines per device SKU."""

__version__ = "0.1.0"
