"""The admission webhook, one concept a module: `views` (the HTTP edge: parse the
AdmissionReview, call one service, answer), `service` (`review_claim`, `fit_alternatives`),
`decision` (the pure decision logic), `store` (its SQL and the PostgreSQL session settings),
`shapes` and `budgets` (per-process caches of the fleet's device shapes and of GPU-hour
budgets).
"""
