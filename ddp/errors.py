"""The one exception type for mistakes a user can fix: a bad config, device, path or launch.

The command line turns it into a single line on stderr and exit code 2 (see train.cli); everything
else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """A user mistake; the message names what to change."""


EXIT_USAGE = 2  # exit code for a UsageError, as argparse and most Unix tools use
