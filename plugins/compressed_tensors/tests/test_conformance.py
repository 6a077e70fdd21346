"""The anyquant conformance kit, run on anyquant-compressed-tensors."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-compressed-tensors"
    package = "anyquant_ct"
    formats = ("compressed-tensors",)
    own_fixtures = ("compressed_tensors",)
