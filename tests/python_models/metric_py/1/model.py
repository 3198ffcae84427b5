"""Custom metrics with pb_utils.MetricFamily (a counter, a gauge, a histogram), written from
Triton's python-backend docs; OUTPUT0 reports what each misuse raised."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.requests = pb_utils.MetricFamily(name="custom_requests", description="Requests seen",
                                              kind=pb_utils.MetricFamily.COUNTER)
        self.depth = pb_utils.MetricFamily(name="custom_depth", description="Last input sum",
                                           kind=pb_utils.MetricFamily.GAUGE)
        self.sizes = pb_utils.MetricFamily(name="custom_sizes", description="Input sizes",
                                           kind=pb_utils.MetricFamily.HISTOGRAM)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.c = self.requests.Metric(labels=labels)
        self.g = self.depth.Metric(labels=labels)
        self.h = self.sizes.Metric(labels=labels, buckets=[1.0, 4.0, 16.0])

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            self.c.increment(1)
            self.g.set(float(x.sum()))
            self.h.observe(float(x.size))
            misuses = (lambda: self.c.increment(-1), lambda: self.c.set(3), lambda: self.h.increment(1),
                       lambda: self.g.observe(1))
            errs = []
            for misuse in misuses:
                try:
                    misuse()
                    errs.append("ok")
                except Exception as e:
                    errs.append(type(e).__name__ + ":" + str(e))
            text = pb_utils.Tensor("OUTPUT0", np.array([["|".join(errs)]], dtype=np.object_))
            value = pb_utils.Tensor("VALUE", np.array([[self.c.value()]], np.float64))
            out.append(pb_utils.InferenceResponse([text, value]))
        return out
