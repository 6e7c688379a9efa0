// The gpuwire device's guard in C++ (see native_guard.py): the answers of torch._C._acc's
// Python guard (one device, index 0, the default stream, events and streams as no-ops) without
// a call into Python for each of them.
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

c10::Device device() {
  return c10::Device(kType, 0);
}

c10::Stream default_stream() {
  return c10::Stream(c10::Stream::DEFAULT, device());
}

struct GpuwireGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return device(); }
  c10::Device getDevice() const override { return device(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return default_stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return default_stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return default_stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

GpuwireGuard guard;

}  // namespace

// Replaces the PrivateUse1 guard registered before (the Python one); returns the device type
// it answers, which the caller checks.
extern "C" int gpuwire_install_guard() {
  c10::impl::device_guard_impl_registry[static_cast<size_t>(kType)].store(&guard);
  return static_cast<int>(guard.type());
}
