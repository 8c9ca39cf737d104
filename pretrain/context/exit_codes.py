"""Process exit codes shared by the trainer and the launch adapters.

Launchers retry only REQUEUE and infrastructure deaths (signals, lost peers, timeouts);
the "do not retry" codes are deterministic and would fail again on fresh hardware.
"""

OK = 0
INFRASTRUCTURE = 1  # lost peer, collective timeout, hang: retry from the last checkpoint
CONFIG_ERROR = 2  # bad config or overrides: fix the command line
TOPOLOGY_REFUSED = 3  # checkpoint cannot be restored into this layout
USER_CODE = 4  # deterministic exception in user code
NUMERIC = 5  # non-finite loss or grad norm
LEASE_HELD = 6  # another live job owns this run directory
RETRY_BUDGET_EXHAUSTED = 7
OOM = 8
DATA = 9  # missing/corrupt data files
CHECKPOINT_IO = 10  # a save could not be written (e.g. disk full) or a restore mismatched
STRAGGLER = 11  # stopped on purpose: a rank is persistently slow (same hardware, same result)
# The job's training ended well, but the object store lacks its newest verified step (the
# launchers' final upload pass failed): the run is safe on the shared tier only.
REMOTE_BEHIND = 12
# This node cannot go on: a process of the job outlived SIGKILL (uninterruptible sleep in a hung
# mount or a driver) or the run dir's storage stopped answering. Launchers only: drain or
# exclude the node, then resume from the newest verified step (on other nodes).
NODE_UNHEALTHY = 14
REQUEUE = 75  # planned exit after an emergency save (EX_TEMPFAIL): requeue me
# Stopped by the user (Ctrl-C, SIGINT) after an emergency save, or at once on a second Ctrl-C:
# 128 + SIGINT, as a shell reports an interrupted command. Not a failure and not a requeue:
# no launcher retries it, and no retry budget counts it.
INTERRUPTED = 130
# INTERRUPTED as a Kubernetes container's exit code: the training-operator recreates a pod that
# exits 128-255, so the user's stop leaves the pod as a permanent failure (1-127) instead.
INTERRUPTED_IN_POD = 13

DO_NOT_RETRY = frozenset(
    {
        CONFIG_ERROR,
        TOPOLOGY_REFUSED,
        USER_CODE,
        NUMERIC,
        LEASE_HELD,
        RETRY_BUDGET_EXHAUSTED,
        OOM,
        DATA,
        CHECKPOINT_IO,
        STRAGGLER,
    }
)
# What no launcher restarts, in place or by requeue: the deterministic failures and the user's
# stop (ft_launcher's in-place restart, a spare node's takeover, the retry policy).
NEVER_RETRIED = DO_NOT_RETRY | {INTERRUPTED}
