// A compiled forward (an AOTInductor package) that runs without holding Python's GIL.
//
// torch's own loader (torch._inductor.aoti_load_package) holds the GIL for the whole forward: a
// prompt step of a second froze the server's event loop for that second, so no request was read
// and no token streamed until the step ended. This loader is the same C++ class, called with the
// GIL released around the forward only; the graph's operators are all C++ (ATen, chapter 02's
// attention, the engine's GEMMs) and never need the interpreter.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/extension.h>

#include <string>
#include <vector>

namespace {

class GraphPackage {
 public:
  explicit GraphPackage(const std::string& path) : loader_(path) {}

  // The graph's outputs for its flat tensor inputs, the GIL released while it runs.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) {
    pybind11::gil_scoped_release no_gil;
    return loader_.run(inputs);
  }

  // The pytree specs of the inputs and outputs, serialized (torch.utils._pytree.treespec_loads).
  std::vector<std::string> call_spec() { return loader_.get_call_spec(); }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<GraphPackage>(m, "GraphPackage")
      .def(pybind11::init<const std::string&>(), pybind11::arg("path"))
      .def("run", &GraphPackage::run, pybind11::arg("inputs"))
      .def("call_spec", &GraphPackage::call_spec);
}
