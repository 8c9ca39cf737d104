# Sourced by cluster_up.sh / cluster_down.sh: where the test cluster lives and how to reach it.
# The project's own adaptation of /work/shared/infra/slurm (Debian 12, Slurm 22.05, root, no
# systemd or cgroups). Defaults differ from the shared recipe (root dir, ports) so both can run
# side by side on one machine.
MCORE_RECIPES_SLURM_ROOT=${MCORE_RECIPES_SLURM_ROOT:-/tmp/mcore-recipes-slurm}
# node1..node2 form the default partition "debug"; "all" has every node (the hot-spare test
# takes a third node from it)
MCORE_RECIPES_SLURM_NODES=${MCORE_RECIPES_SLURM_NODES:-3}
MCORE_RECIPES_SLURM_CPUS=${MCORE_RECIPES_SLURM_CPUS:-2}
MCORE_RECIPES_SLURM_MEM_MB=${MCORE_RECIPES_SLURM_MEM_MB:-8192}
MCORE_RECIPES_SLURM_PORT=${MCORE_RECIPES_SLURM_PORT:-7817}
# A requeued job waits cred_expire + 1 s before it may start again (Slurm's default: 121 s).
MCORE_RECIPES_SLURM_CRED_EXPIRE=${MCORE_RECIPES_SLURM_CRED_EXPIRE:-10}

ROOT=$MCORE_RECIPES_SLURM_ROOT
RUN=$ROOT/run
export SLURM_CONF=$ROOT/etc/slurm.conf

# alive = exists and is not a zombie (PID 1 in a container may reap orphans late)
alive() {
    local st
    st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "$st" != Z ]
}

pidfile_alive() { [ -f "$1" ] && alive "$(cat "$1")"; }

# Healthy = every recorded daemon runs, slurmctld answers and no node is down/drained.
cluster_healthy() {
    [ -f "$SLURM_CONF" ] || return 1
    pidfile_alive "$RUN/munged.pid" && pidfile_alive "$RUN/slurmctld.pid" || return 1
    local i
    for i in $(seq 1 "$MCORE_RECIPES_SLURM_NODES"); do
        pidfile_alive "$RUN/slurmd-node$i.pid" || return 1
    done
    timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' || return 1
    local states
    states=$(timeout 10 sinfo -h -N -o '%T' 2>/dev/null) || return 1
    [ "$(grep -c . <<<"$states")" -ge "$MCORE_RECIPES_SLURM_NODES" ] || return 1
    ! grep -qvE '^(idle|mixed|allocated|completing)$' <<<"$states"
}
