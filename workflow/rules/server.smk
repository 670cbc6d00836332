# The inference server at the start and the end of a run (fetch and extract control it themselves, through
# dflash-eval).
import subprocess
import sys

from dflash_eval.errors import DflashEvalError
from dflash_eval.server.control import ServerController
from dflash_eval.server.runs import start_run


def reclaim_server(dry_run: bool) -> None:
    """When the run's own Snakemake loads this file (not a job's, not a cluster job's): end what a run that died
    without its end-of-run hook left behind (an outage no live job holds, a managed server that a run which is
    gone launched), in one line on stderr. Here rather than in onstart, which Snakemake skips when there is
    "Nothing to be done". A dry run only says what it found. Never fails the load: fetch and extraction
    check the server again."""
    try:
        line = ServerController(cfg.server_settings(config)).reclaim(act=not dry_run)
    except DflashEvalError as error:
        line = f"dflash-eval: could not check the server for what an earlier run left behind: {error}"
    if line:
        print(line, file=sys.stderr)


def dry_run() -> bool:
    """`snakemake -n`: while the Snakefile loads, Snakemake has not set its executor yet (workflow.dryrun is
    False even for -n), so the command line says it (-n, -np, --dry-run, --dryrun)."""
    flags = [a for a in sys.argv[1:] if a.startswith("-")]
    return workflow.dryrun or any(
        a in ("--dry-run", "--dryrun")
        or (not a.startswith("--") and a[1:].isalpha() and "n" in a[1:])
        for a in flags
    )


if (
    start_run()
):  # marks this process as the run: what jobs launch is recorded with it as the owner
    reclaim_server(dry_run())


def finish_server() -> None:
    """onsuccess/onerror: restore a server that a killed extraction left down (idempotent: nothing to do
    when every extraction restored it), then stop a managed server this run launched unless keep_running.

    A failure is reported, not raised: Snakemake has already decided the run's outcome.
    """
    settings = settings_param(cfg.server_settings(config))
    done = subprocess.run(
        ["dflash-eval", "server", "finish", "--settings", settings], check=False
    )
    if done.returncode != 0:
        print(
            f"dflash-eval server finish exited with {done.returncode}: check the server "
            f"({config['server']['base_url']}) and {config['server']['log_dir']}/transitions.jsonl"
        )
