"""The anyquant conformance kit, run on anyquant-bnb."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-bnb"
    package = "anyquant_bnb"
    formats = ("bnb",)
    own_fixtures = ("bnb_4bit",)
