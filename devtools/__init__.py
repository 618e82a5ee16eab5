"""Development tools that the tests and the benchmarks share (never imported by the product):
`devtools.fake_kube`, the local Kubernetes API server the real client is tested against."""
