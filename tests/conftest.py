"""Settings for every tier."""

from hypothesis import settings

# No time limit per generated example: these machines are shared and noisy (and the VM tier
# keeps both cores busy), and speed is measured in bench/, never asserted in tests.
settings.register_profile("corral", deadline=None)
settings.load_profile("corral")
