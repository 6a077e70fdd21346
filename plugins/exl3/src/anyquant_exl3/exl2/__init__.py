"""EXL2 (exllamav2), the older format this plugin also reads: ``dequant`` (the pure-torch decoder and packer),
``qlinear`` (``EXL2Linear``), ``loader`` (``EXL2Loader``). Detection is in :mod:`anyquant_exl3.plugin`."""
