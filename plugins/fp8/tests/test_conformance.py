"""The anyquant conformance kit, run on anyquant-fp8."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-fp8"
    package = "anyquant_fp8"
    formats = ("fp8",)
    own_fixtures = ("fp8",)
