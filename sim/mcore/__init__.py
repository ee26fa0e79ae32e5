"""megatron-core's differences between releases, behind one package.

Every release question is answered by feature, read from the installed source once per process
(`installed_features`), the same in the controller and in a rank. See
`pipemetrics.sim.mcore.features`. The routing table every part of pipemetrics derives its routing
facts from is `pipemetrics.sim.mcore.routing`.
"""

from pipemetrics.sim.mcore.features import (
    MTP_ON_THE_LAST_STAGE,
    DpRule,
    InstalledFeatures,
    MtpAvgRole,
    MtpNumbering,
    RouterRouting,
    installed_features,
    read_installed_features,
)

__all__ = [
    "MTP_ON_THE_LAST_STAGE",
    "DpRule",
    "InstalledFeatures",
    "MtpAvgRole",
    "MtpNumbering",
    "RouterRouting",
    "installed_features",
    "read_installed_features",
]
