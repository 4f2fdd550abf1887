"""MetaSchedule tuning logs shipped with tvm_fuel (data only; installed as ``tvm_fuel.tuning_logs``)."""
