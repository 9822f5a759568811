"""Hypothesis settings profiles of the property suite.

``ci``    derandomized, a fixed number of examples per property, no deadline,
          no example database (a CI run is a pure function of the code), the
          failing example's blob printed. The default.
``dev``   a quick local loop: fewer random examples, the database on so that a
          failure found once is replayed first next time.
``fuzz``  many random examples, for the fuzz command and nightly runs.
``repro`` one case, verbose, no shrinking: replaying a REPRO line must show
          that exact case failing, not a smaller one.

Selected by ``--mqa-profile NAME`` or the environment variable ``MQA_PROFILE``;
``ci`` when neither is given (so also under ``CI=true``).
"""

import os

from hypothesis import HealthCheck, Phase, Verbosity, settings

ENV_VAR = "MQA_PROFILE"
DEFAULT = "ci"

#: Examples per property in the ci profile (the issue's floor is 300).
CI_EXAMPLES = 300
DEV_EXAMPLES = 40
FUZZ_EXAMPLES = 5000

#: Examples of a property that starts processes (checks.SPAWNING: each pays the processes' start-up),
#: by profile: a few in ci and dev keep the default run fast; fuzz's time slices bound the rest.
SPAWNING_EXAMPLES = {"ci": 2, "dev": 2, "fuzz": FUZZ_EXAMPLES, "repro": 1}

# Our examples are seconds-scale on a GPU and milliseconds on the CPU model;
# timing is the benchmark's business, never a property verdict.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PROFILES = {
    "ci": settings(
        max_examples=CI_EXAMPLES, derandomize=True, database=None, print_blob=True, **_COMMON
    ),
    "dev": settings(max_examples=DEV_EXAMPLES, print_blob=True, **_COMMON),
    "fuzz": settings(max_examples=FUZZ_EXAMPLES, print_blob=True, **_COMMON),
    "repro": settings(
        max_examples=1,
        derandomize=True,
        database=None,
        print_blob=True,
        verbosity=Verbosity.verbose,
        phases=(Phase.explicit, Phase.generate),
        **_COMMON,
    ),
}


def register() -> None:
    for name, profile in PROFILES.items():
        settings.register_profile(f"mqa-{name}", profile)


def chosen(flag: str | None = None) -> str:
    """The profile name: the flag, else $MQA_PROFILE, else ``ci``."""
    name = flag or os.environ.get(ENV_VAR) or DEFAULT
    if name not in PROFILES:
        raise ValueError(f"{ENV_VAR} / --mqa-profile: unknown profile {name!r}; one of {sorted(PROFILES)}")
    return name


def load(name: str) -> None:
    register()
    settings.load_profile(f"mqa-{name}")


def examples_for_mutant_kills() -> settings:
    """The mutant self-test: dev-sized, but derandomized and without shrinking.

    Derandomized so that a kill is a fact of the code, not of the day; no
    shrinking because the self-test only needs to know that a property
    catches the mutant, and shrinking would multiply its run time.
    """
    return settings(
        PROFILES["dev"],
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        print_blob=False,
    )
