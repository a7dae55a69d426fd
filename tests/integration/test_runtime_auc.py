"""A binary model is judged by its AUC: `tfps local` trains the wide-and-deep click model of
examples/wide-deep.yaml (2 PS, 2 workers, bounded staleness, a 100k-id vocabulary) and reports the
test split's ROC AUC next to its accuracy. The data's own AUC (the generator's true logits) is
0.91 and a model that learned nothing scores 0.5, so the bound sits between the two. (On the cluster
the same example runs in tests/e2e/test_helm_examples.py, its AUC in status.progress.auc.)"""

from pathlib import Path

import pytest
from support import tfps_local

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

AUC_AT_LEAST = 0.80  # also in tests/e2e/test_helm_examples.py
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "wide-deep.yaml"


def test_wide_deep_reaches_the_stated_auc_and_reports_it():
    result = tfps_local(EXAMPLE, timeout=240)
    assert result["phase"] == "Succeeded" and result["steps"] == 600
    assert result["auc"] >= AUC_AT_LEAST, result
    assert 0.5 < result["accuracy"] < 1.0, result
