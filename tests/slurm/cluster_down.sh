#!/usr/bin/env bash
# cluster_down.sh - stop the test cluster started by cluster_up.sh: cancel its jobs, then stop
# only the daemons whose PIDs it recorded. Safe to run when nothing is up. Logs stay in
# $MCORE_RECIPES_SLURM_ROOT/log for post-mortems.
set -uo pipefail
source "$(dirname "$0")/common.sh"
[ -d "$RUN" ] || { echo "cluster_down: nothing recorded under $ROOT"; exit 0; }

# Cancel whatever is still queued/running so the slurmstepd's (and trainers) go away cleanly.
if pidfile_alive "$RUN/slurmctld.pid"; then
    timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
    for _ in $(seq 100); do [ -z "$(timeout 5 squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
fi

stop_pids() {   # args: pidfiles; TERM all, wait up to 10 s, then KILL
    local f pid pids=() any
    for f in "$@"; do
        [ -f "$f" ] || continue
        pid=$(cat "$f"); rm -f "$f"
        alive "$pid" && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    [ "${#pids[@]}" = 0 ] && return 0
    for _ in $(seq 100); do
        any=0
        for pid in "${pids[@]}"; do alive "$pid" && any=1; done
        [ "$any" = 0 ] && return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null; done
    return 0
}
stop_pids "$RUN"/slurmd-*.pid
stop_pids "$RUN/slurmctld.pid"
stop_pids "$RUN/munged.pid"
echo "cluster_down: stopped (logs in $ROOT/log)"
