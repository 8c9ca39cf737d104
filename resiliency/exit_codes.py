"""Process exit codes shared by the trainer and the launch adapters.

Launchers retry only REQUEUE and infrastructure deaths (signals, lost peers); the
"do not retry" codes are deterministic and would fail again on fresh hardware.
"""

OK = 0
CONFIG_ERROR = 2        # bad config or overrides: fix the command line
TOPOLOGY_REFUSED = 3    # checkpoint cannot be restored into this layout: don't retry
USER_CODE = 4           # deterministic exception in user code / data: don't retry
NUMERIC = 5             # non-finite loss or grad norm: don't retry
LEASE_HELD = 6          # another live job owns this run directory: don't retry
RETRY_BUDGET_EXHAUSTED = 7
REQUEUE = 75            # planned exit after an emergency save (EX_TEMPFAIL): requeue me

DO_NOT_RETRY = frozenset({CONFIG_ERROR, TOPOLOGY_REFUSED, USER_CODE, NUMERIC, LEASE_HELD,
                          RETRY_BUDGET_EXHAUSTED})
