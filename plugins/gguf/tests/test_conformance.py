"""The anyquant conformance kit, run on anyquant-gguf."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-gguf"
    package = "anyquant_gguf"
    formats = ("gguf",)
    own_fixtures = ("gguf",)
