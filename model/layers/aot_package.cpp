// The ahead-of-time decode-step package (model/engine/aot_step.py) called through ops of our own: a torch.ops call
// releases the GIL while it runs, where torch._C._aoti.AOTIModelPackageLoader.run holds it for the whole step, so
// the server's event loop (HTTP, SSE, detokenizing) stalled behind every decode step. Packages are held here by an
// integer handle.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Package = torch::inductor::AOTIModelPackageLoader;

std::mutex packages_lock;
std::vector<std::shared_ptr<Package>> packages;  // a released handle's slot is null

std::shared_ptr<Package> package(int64_t handle) {
  std::lock_guard<std::mutex> guard(packages_lock);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(packages.size()) && packages[handle],
              "aot package: no package with handle ", handle);
  return packages[handle];
}

int64_t aot_package_load(const std::string& path) {
  auto loaded = std::make_shared<Package>(path, "model", false, 1, -1);
  std::lock_guard<std::mutex> guard(packages_lock);
  packages.push_back(std::move(loaded));
  return static_cast<int64_t>(packages.size()) - 1;
}

std::vector<std::string> aot_package_constant_names(int64_t handle) { return package(handle)->get_constant_fqns(); }

// The tensors are bound, not copied (user-managed): the caller keeps them alive while the package is loaded.
void aot_package_bind(int64_t handle, const std::vector<std::string>& names, const std::vector<at::Tensor>& values) {
  TORCH_CHECK(names.size() == values.size(), "aot package: ", names.size(), " names for ", values.size(), " tensors");
  std::unordered_map<std::string, at::Tensor> constants;
  for (size_t i = 0; i < names.size(); ++i) constants.emplace(names[i], values[i]);
  package(handle)->load_constants(constants, false, true, true);
}

std::vector<at::Tensor> aot_package_run(int64_t handle, const std::vector<at::Tensor>& inputs) {
  return package(handle)->run(inputs);
}

void aot_package_release(int64_t handle) {
  std::shared_ptr<Package> released;  // destroyed outside the lock
  std::lock_guard<std::mutex> guard(packages_lock);
  if (handle >= 0 && handle < static_cast<int64_t>(packages.size())) released.swap(packages[handle]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_kernels, m) {
  m.def("aot_package_load(str path) -> int", &aot_package_load);
  m.def("aot_package_constant_names(int handle) -> str[]", &aot_package_constant_names);
  m.def("aot_package_bind(int handle, str[] names, Tensor[] values) -> ()", &aot_package_bind);
  m.def("aot_package_run(int handle, Tensor[] inputs) -> Tensor[]", &aot_package_run);
  m.def("aot_package_release(int handle) -> ()", &aot_package_release);
}
