"""Process exit codes shared by every verb and read by the supervisor."""

#: Finished; outputs are complete.
OK = 0
#: Failed; rerunning the same command will likely fail again.
FAILED = 1
#: Bad command line, config or input data; nothing was started.
USAGE = 2
#: Preempted: an emergency checkpoint was committed; rerun the same command to resume.
#: (EX_TEMPFAIL from sysexits.h: "temporary failure, the user is invited to retry".)
PREEMPTED = 75
#: A second preemption signal arrived during the emergency save: exited at once,
#: the previous committed checkpoint is intact; rerun to resume from it.
PREEMPTED_HARD = 76

RESUMABLE = frozenset({PREEMPTED, PREEMPTED_HARD})
