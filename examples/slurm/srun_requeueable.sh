# shellcheck shell=bash
# Sourced by the sbatch scripts beside it: run one srun step that a time limit or a
# preemption can stop, and requeue the job when the run saved a checkpoint and stopped
# early, so that the next allocation resumes from it (docs/clusters.md, "SLURM").
#
#   srun_requeueable [srun options ...] COMMAND ...
#
# How the signal travels: `#SBATCH --signal=B:USR1@300` sends SIGUSR1 to this batch shell
# only (B:), 300 s before the time limit; the trap below passes it to srun, which forwards
# it to every task of the step. bridge-train (train.exit_signal_handler=true,
# train.exit_signal=10) finishes the step it is in, saves a checkpoint on every rank and
# exits with --requeue-exit-code ($BRIDGE_REQUEUE_EXIT_CODE). A signal sent to the tasks
# directly (`--signal=USR1@300` without B:, `scancel --signal=USR1 JOBID`) ends the same
# way. The job is requeued (`#SBATCH --requeue`) when srun returns that code, or when the
# signal came and the step did not end with 0 (a launcher such as ft_launcher exits
# non-zero, not 75, when its workers stopped with 75 after a signal); a step that ends with
# 0 (the run finished) ends the job, any other code ends it with that code.
# BRIDGE_STOP_SIGNAL names another signal to trap (TERM for ft_launcher, which forwards
# only SIGTERM, SIGINT, SIGHUP and SIGQUIT).

BRIDGE_REQUEUE_EXIT_CODE=${BRIDGE_REQUEUE_EXIT_CODE:-75}  # EX_TEMPFAIL: "try again later"
BRIDGE_STOP_SIGNAL=${BRIDGE_STOP_SIGNAL:-USR1}

srun_requeueable() {
    local srun_pid status interrupted signalled=""
    # shellcheck disable=SC2317  # run by the trap
    forward() {
        interrupted=1
        signalled=1
        echo "[slurm] job ${SLURM_JOB_ID}: SIG${BRIDGE_STOP_SIGNAL} received; asking every task to save and stop"
        kill -"$BRIDGE_STOP_SIGNAL" "$srun_pid" 2>/dev/null || true
    }
    trap forward "$BRIDGE_STOP_SIGNAL"
    # Not --kill-on-bad-exit: the ranks exit with the requeue code a few seconds apart, and
    # the first one's code would get the others killed in their teardown (exit 143, no
    # requeue). --wait still ends a step whose rank died: the others get 300 s to finish,
    # instead of waiting for dist.distributed_timeout_minutes.
    srun --kill-on-bad-exit=0 --wait=300 "$@" &
    srun_pid=$!
    while :; do
        interrupted=""
        status=0
        wait "$srun_pid" || status=$?
        # The trap cuts `wait` short (status > 128) while srun still runs: wait again.
        if [[ -n $interrupted ]] && kill -0 "$srun_pid" 2>/dev/null; then continue; fi
        break
    done
    trap - "$BRIDGE_STOP_SIGNAL"
    if [[ $status -eq $BRIDGE_REQUEUE_EXIT_CODE || (-n $signalled && $status -ne 0) ]]; then
        echo "[slurm] job ${SLURM_JOB_ID}: the run stopped before its end (srun exit code $status); requeueing it"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    echo "[slurm] job ${SLURM_JOB_ID}: srun exited with code $status"
    return "$status"
}
