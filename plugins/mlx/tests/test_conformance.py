"""The anyquant conformance kit, run on anyquant-mlx."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-mlx"
    package = "anyquant_mlx"
    formats = ("mlx",)
    own_fixtures = ("mlx",)
