"""The accounts of an MLflow server run with its basic-auth app (`mlflow server --app-name basic-auth`,
`default_permission = NO_PERMISSIONS`), provisioned through MLflow's own auth client:

| role       | who                                   | registered model | experiment |
|------------|---------------------------------------|------------------|------------|
| `pipeline` | the retrain flow's service account    | EDIT             | EDIT       |
| `reviewer` | a person who promotes and rolls back  | EDIT             | READ       |
| `reader`   | `xbn serve`, the catalogue workers    | READ             | READ       |
| admin      | the server's admin (creates the rest) | all              | all        |

EDIT may register versions, move aliases and write tags; only MANAGE deletes, and nobody but the admin has it:
the admin creates the registered model and the experiment here, so no other account owns them (MLflow gives
the creator of a resource MANAGE on it).

    MLFLOW_TRACKING_USERNAME=admin MLFLOW_TRACKING_PASSWORD=... XBN_PASSWORD_XBN_PIPELINE=... \\
    python -m xbn.tracking.accounts --uri http://mlflow:5000 --account pipeline:xbn-pipeline \\
        --account reader:xbn-serve --account reviewer:alice

Each account's password comes from an environment variable, `XBN_PASSWORD_<NAME>` (the name upper-cased, other
characters than letters and digits as `_`) unless the spec names one (`ROLE:USERNAME:VARIABLE`), never from the
command line. Running it again updates passwords and
permissions to the table: it is the record of who may do what.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

# role -> (permission on the registered model, permission on the experiment)
ROLES = {"pipeline": ("EDIT", "EDIT"), "reviewer": ("EDIT", "READ"), "reader": ("READ", "READ")}


@dataclass(frozen=True)
class Account:
    role: str
    username: str
    password: str


def password_variable(username: str) -> str:
    return "XBN_PASSWORD_" + re.sub(r"[^A-Za-z0-9]", "_", username).upper()


def provision(uri: str, model_name: str, experiment: str, accounts: list[Account]) -> list[str]:
    """Create (or update) `accounts` on the basic-auth MLflow server at `uri` with their role's permissions on
    `model_name` and `experiment`, as the admin of MLFLOW_TRACKING_USERNAME/PASSWORD; returns what was done."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client
    from mlflow.tracking import MlflowClient

    auth, client, done = get_app_client("basic-auth", tracking_uri=uri), MlflowClient(uri), []
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    try:
        client.get_registered_model(model_name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_registered_model(model_name)
        done.append(f"created registered model {model_name} (owned by the admin)")
    for account in accounts:
        if account.role not in ROLES:
            raise ValueError(f"unknown role {account.role!r} for {account.username} (roles: {', '.join(ROLES)})")
        try:
            auth.get_user(account.username)
            auth.update_user_password(account.username, account.password)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            auth.create_user(account.username, account.password)
        model_permission, experiment_permission = ROLES[account.role]
        for kind, resource, permission in (("registered_model", model_name, model_permission),
                                           ("experiment", experiment_id, experiment_permission)):
            current = auth.get_user_permission(account.username, kind, resource).permission
            if current != permission:
                if current not in (None, "NO_PERMISSIONS"):
                    auth.revoke_user_permission(account.username, kind, resource)
                auth.grant_user_permission(account.username, kind, resource, permission)
        done.append(f"{account.username}: {account.role} ({model_permission} on {model_name}, "
                    f"{experiment_permission} on experiment {experiment})")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xbn.tracking.accounts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI"), help="the MLflow server")
    parser.add_argument("--model-name", default="xbn-embedder")
    parser.add_argument("--experiment", default="xbn")
    parser.add_argument("--account", action="append", default=[], metavar="ROLE:USERNAME[:PASSWORD_VARIABLE]",
                        help=f"repeatable; roles: {', '.join(ROLES)}; the password is read from the environment "
                             "variable named (default XBN_PASSWORD_<USERNAME>)")
    args = parser.parse_args(argv)
    if not args.uri:
        parser.error("--uri (or MLFLOW_TRACKING_URI) is required")
    accounts = []
    for spec in args.account:
        role, _, rest = spec.partition(":")
        username, _, variable = rest.partition(":")
        variable = variable or password_variable(username)
        password = os.environ.get(variable, "")
        if not username or not password:
            parser.error(f"--account {spec}: give ROLE:USERNAME[:PASSWORD_VARIABLE], and the password in {variable}")
        accounts.append(Account(role, username, password))
    for line in provision(args.uri, args.model_name, args.experiment, accounts):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
