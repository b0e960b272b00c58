"""The inspect stage: drives ``ditbook.arch`` on the loaded pipeline (static facts and one traced
generation), writes the facts, the code-surface report and the integration plan a reviewer
approves (``ditbook.approval``)."""
