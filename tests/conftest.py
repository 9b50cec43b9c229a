import os

import hypothesis

# Deterministic, CI-sized property runs; `HYPOTHESIS_PROFILE=thorough` for a deeper local search.
hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.register_profile("thorough", max_examples=500, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
