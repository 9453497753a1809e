# shellcheck shell=bash
# Sourced by launch/local.sh and launch/tpu_pod.sh: what a launcher makes of the exit statuses
# of a job's cem-train processes (launch/README.md, docs/exit_statuses.md).

# combined_status CODES: the status of a run from its trainers' exit statuses (one a line):
# 3 or 2 (diverged, cannot run as configured: every worker would do it again) first, then a
# crash or a kill (1, 137, ...: the run failed), then 75 (stopped for a reason a relaunch gets
# past: a signal, a lost peer, unreachable storage; workers that finished meanwhile, 0, finish
# again at once when it runs again); none reported, or only 0s (ssh or gcloud failed: the
# caller saw a failure), is 255.
combined_status() {
  local code
  for code in 3 2; do
    if grep -qx "$code" <<<"$1"; then return "$code"; fi
  done
  for code in $1; do
    [[ $code == 0 || $code == 75 ]] || return "$code"
  done
  if grep -qx 75 <<<"$1"; then return 75; fi
  return 255
}
